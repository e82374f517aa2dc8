"""GPU utilization (daemon/gpunode/gpu.py): the NVML sampler, the daemon's low-utilization
watch, and the path from an agent's heartbeat to ``gpu_underutilized``.

The NVML calls themselves need a GPU: on a machine without one the sampler is
tested for real (pynvml raises NVMLError → absent); the mapping of NVML's answers
is tested with NVML's functions replaced; the heartbeat path with an injected sampler.
"""

from __future__ import annotations

import types

import pynvml
import pytest

from daemon.controlnode.gpu_watch import GpuWatch, mean_sm_util, parse_samples
from daemon.gpunode.gpu import GpuMeans, GpuSample, NvmlSampler
from daemon.model import NodeState


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_nvml_sampler_on_this_machine() -> None:
    sampler = NvmlSampler()
    try:
        got = sampler.sample()
        if not _nvml_works():  # a CPU machine (CI): absent, with the reason, never zeros
            assert got is None
            assert sampler.reason.startswith("NVML unavailable")
            assert sampler.sample() is None  # and it stays absent without retrying NVML
        else:
            assert got, "NVML works, so the sampler must see the GPUs"
            assert [g.index for g in got] == list(range(len(got)))
            for g in got:
                assert g.sm_util_pct is not None and 0 <= g.sm_util_pct <= 100
                assert g.mem_total_bytes and 0 <= g.mem_used_bytes <= g.mem_total_bytes
    finally:
        sampler.close()
        sampler.close()  # idempotent
    assert sampler.sample() is None  # closed


def test_nvml_answers_map_to_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def failing_gpu1(handle):
        if handle == "h1":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return types.SimpleNamespace(gpu=37, memory=5)

    fake = {
        "nvmlInit": lambda: calls.append("init"),
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: f"h{i}",
        "nvmlDeviceGetName": lambda h: b"NVIDIA H100 80GB HBM3" if h == "h0" else "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetUtilizationRates": failing_gpu1,
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)
    sampler = NvmlSampler()
    got = sampler.sample()
    assert got == [
        GpuSample(0, 37.0, 3 * 2**30, 80 * 2**30, "NVIDIA H100 80GB HBM3"),
        GpuSample(1, None, None, None, "NVIDIA H100 80GB HBM3"),  # a lost GPU: unknown, not 0 %
    ]
    assert mean_sm_util(got) == 37.0  # only GPUs that answered count
    sampler.close()
    assert calls == ["init", "shutdown"]

    # a driver that sees no GPU: absent too
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    empty = NvmlSampler()
    assert empty.sample() is None and empty.reason == "NVML sees no GPU"


@pytest.mark.parametrize("raw", [None, "gpu", [{"sm_util_pct": 3}], [1, 2], {"index": 0}])
def test_bad_or_absent_payloads_are_absent(raw: object) -> None:
    assert parse_samples(raw) is None


def test_payload_round_trip() -> None:
    sample = [GpuSample(0, 12.5, 10, 100, "A"), GpuSample(1, None, None, None)]
    assert parse_samples([s.to_dict() for s in sample]) == sample
    assert parse_samples([]) is None  # no GPU listed: absent


def low(pct: float, gpus: int = 2) -> list[GpuSample]:
    return [GpuSample(i, pct, 1, 2) for i in range(gpus)]


def test_watch_fires_once_per_episode() -> None:
    w = GpuWatch(threshold_pct=50, window_s=300)
    t = 1000.0
    fired = []
    for k in range(0, 301, 10):  # 30 % for 300 s, one sample every 10 s
        fired.append((k, w.observe("n1", low(30), now=t + k, training=True)))
    hits = [(k, ev) for k, ev in fired if ev is not None]
    assert [k for k, _ in hits] == [300]
    ev = hits[0][1]
    assert ev == {"mean_sm_util_pct": 30.0, "last_sm_util_pct": 30.0, "threshold_pct": 50, "window_s": 300,
                  "below_since": 1000.0, "gpus": 2}
    assert w.observe("n1", low(10), now=t + 400, training=True) is None  # same episode: no second event
    assert w.observe("n1", low(50), now=t + 410, training=True) is None  # at the threshold: episode over
    assert w.observe("n1", low(20), now=t + 420, training=True) is None  # a new one starts
    assert w.observe("n1", low(20), now=t + 719, training=True) is None
    again = w.observe("n1", low(40), now=t + 720, training=True)
    assert again is not None and again["below_since"] == t + 420 and again["mean_sm_util_pct"] == 26.7  # (20 + 20 + 40) / 3


def test_watch_needs_training_and_a_sample() -> None:
    w = GpuWatch(threshold_pct=50, window_s=60)
    assert w.observe("n1", low(5), now=0, training=True) is None
    assert w.observe("n1", None, now=30, training=True) is None  # absent: no judgement, the episode ends
    assert w.observe("n1", low(5), now=60, training=True) is None  # so 60 s after the first is not a window
    assert w.observe("n1", low(5), now=100, training=False) is None  # booting / draining: idle is expected
    assert w.observe("n1", low(5), now=200, training=True) is None
    assert w.observe("n1", low(5), now=260, training=True) is not None
    assert w.observe("n2", None, now=0, training=True) is None and w.latest("n2") is None
    w.forget("n1")
    assert w.latest("n1") is None


@pytest.mark.parametrize("kw", [{"threshold_pct": 0}, {"threshold_pct": 101}, {"window_s": 0}])
def test_watch_refuses_bad_settings(kw: dict) -> None:
    with pytest.raises(ValueError):
        GpuWatch(**kw)


def test_gpu_means_fold_the_samples_between_two_heartbeats() -> None:
    """A long heartbeat interval: the heartbeat carries each GPU's mean over the interval,
    so a GPU busy half the time reads 50 %, whatever instant the heartbeat falls on."""
    m = GpuMeans()
    assert m.take() is None and m.samples == 0  # nothing yet: absent
    for util in (0.0, 100.0, 0.0, 100.0):
        m.add([GpuSample(0, util, 2**30, 16 * 2**30, "T4"), GpuSample(1, 30.0, 2**29, 16 * 2**30, "T4")])
    m.add([GpuSample(0, None, 3 * 2**30, 16 * 2**30, "T4"), GpuSample(1, 30.0, 2**29, 16 * 2**30, "T4")])
    assert m.samples == 5
    assert m.take() == [GpuSample(0, 50.0, 3 * 2**30, 16 * 2**30, "T4"), GpuSample(1, 30.0, 2**29, 16 * 2**30, "T4")]
    assert m.samples == 0 and m.take() is None  # it starts over
    m.add(None)  # a CPU node, or the GPUs fell off NVML
    assert m.take() is None
    m.add([GpuSample(0, None, None, None)])  # the GPU is there but could not be read
    assert m.take() == [GpuSample(0, None, None, None)]
    w = GpuWatch(threshold_pct=50, window_s=40)  # 20 s heartbeats of means: the window needs 3
    low = [GpuSample(0, 45.0, 1, 2)]
    assert [w.observe("n", low, now=t, training=True) is not None for t in (0, 20, 40)] == [False, False, True]


class ScriptedSampler:
    """An injected sampler: returns ``value`` (a list of samples, or None for a CPU node)."""

    def __init__(self, value: list[GpuSample] | None) -> None:
        self.value = value
        self.calls = 0
        self.closed = False

    def sample(self) -> list[GpuSample] | None:
        self.calls += 1
        return self.value

    def close(self) -> None:
        self.closed = True


async def test_heartbeat_samples_reach_the_daemon(spot_daemon, monkeypatch) -> None:
    from test_ctl import agent_on_first_node, spotctl

    h = spot_daemon
    h.sup.agents.gpu_watch = GpuWatch(threshold_pct=50, window_s=0.3)  # seconds, so the test is short
    sampler = ScriptedSampler([GpuSample(0, 20.0, 2**30, 16 * 2**30, "T4"), GpuSample(1, 30.0, 2**30, 16 * 2**30)])
    async with agent_on_first_node(h, monkeypatch, sampler=sampler) as agent:
        await h.until(lambda: h.events("gpu_underutilized"), what="gpu_underutilized")
        (ev,) = h.events("gpu_underutilized")
        node = h.sup.nodes[ev.node]
        assert node.state is NodeState.RUNNING and node.trainer == "running"
        assert ev.data["threshold_pct"] == 50 and ev.data["gpus"] == 2 and ev.data["mean_sm_util_pct"] == 25.0
        rc, out, err = await spotctl("--socket", h.socket_path, "nodes")
        assert rc == 0, err
        assert out.splitlines()[0].split()[-1] == "SM%" and out.splitlines()[1].split()[-1] == "25%"

        sampler.value = None  # the GPUs vanish from NVML: absent, not 0 %
        n = sampler.calls
        await h.until(lambda: sampler.calls > n + 2 and h.sup.agents.gpu_watch.latest(node.id) is None, what="absent")
        rc, out, err = await spotctl("--socket", h.socket_path, "nodes")
        assert out.splitlines()[1].split()[-1] == "n/a"
        assert len(h.events("gpu_underutilized")) == 1
    assert sampler.closed and agent.gpu_sampler is sampler

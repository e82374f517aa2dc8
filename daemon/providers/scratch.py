"""Instance-store NVMe disks as the node's checkpoint scratch (a user-data snippet).

Instance types such as p4d.24xlarge (8 x 1 TB) and p5.48xlarge (8 x 3.8 TB) carry local
NVMe SSDs that are far faster than the root EBS volume (gp3: 125 MiB/s unless
provisioned higher) and free. On Nitro instances they need no block device mapping: they
appear by themselves as NVMe devices whose model is "Amazon EC2 NVMe Instance Storage"
(EBS volumes read "Amazon Elastic Block Store"), unformatted and unmounted
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/InstanceStorage.html,
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/add-instance-store-volumes.html).

The snippet, run by the node's first-boot script as root before the agent starts:

1. lists whole disks with ``lsblk -dnpo NAME,MODEL`` and keeps the instance-store ones;
2. none: does nothing (scratch stays on the root volume);
3. one: formats it; several: makes a RAID 0 of them with ``mdadm`` (striping adds their
   throughput; scratch holds checkpoint shards before upload, and an instance-store disk
   lives no longer than its instance anyway) and formats that;
4. mounts it (ext4, ``noatime``) at the agent's scratch directory
   (``<agent workdir>/scratch``: ``systemd/spotvisor-agent.service`` runs the agent with
   ``--workdir /var/lib/spotvisor-agent``, and ``daemon/gpunode/trainer_process.py`` gives
   the trainer ``$SPOTVISOR_SCRATCH_DIR`` = workdir/scratch), adds an fstab line with
   ``nofail`` (a reboot keeps instance-store data), and hands the directory to the
   ``spotvisor`` user when it exists (the unit's ``StateDirectory=`` re-owns it otherwise).

A failure here never stops the bootstrap: the node then keeps its scratch on the root
volume and says so on stderr (the cloud-init log), rather than never registering.
"""

from __future__ import annotations

import shlex

__all__ = ["SCRATCH_DIR", "INSTANCE_STORE_MODEL", "scratch_snippet"]

# the agent's workdir on a cloud node (systemd/spotvisor-agent.service) + "scratch"
SCRATCH_DIR = "/var/lib/spotvisor-agent/scratch"
INSTANCE_STORE_MODEL = "Amazon EC2 NVMe Instance Storage"

_SNIPPET = r"""# instance-store NVMe as checkpoint scratch (daemon/providers/scratch.py)
spotvisor_scratch() {{
  local dir={dir} fstab={fstab} dev disks=() name model
  while read -r name model; do
    [ "$model" = {model} ] && disks+=("$name")
  done < <(lsblk -dnpo NAME,MODEL)
  if [ "${{#disks[@]}}" -eq 0 ]; then
    echo "spotvisor: no instance-store disk; scratch stays on the root volume" >&2
    return 0
  fi
  install -d -m 0750 "$dir" || return 1
  mountpoint -q "$dir" && return 0
  if [ "${{#disks[@]}}" -eq 1 ]; then
    dev="${{disks[0]}}"
  else
    dev=/dev/md/spotvisor-scratch
    mdadm --create "$dev" --run --force --level=0 --raid-devices="${{#disks[@]}}" "${{disks[@]}}" || return 1
  fi
  mkfs.ext4 -q -F -L spotvisor-scr -E nodiscard,lazy_itable_init=1 "$dev" || return 1
  mount -o noatime "$dev" "$dir" || return 1
  echo "LABEL=spotvisor-scr $dir ext4 noatime,nofail 0 2" >> "$fstab"
  if id -u spotvisor >/dev/null 2>&1; then chown spotvisor:spotvisor "$dir"; fi
  echo "spotvisor: scratch on ${{#disks[@]}} instance-store disk(s) at $dir" >&2
}}
spotvisor_scratch || echo "spotvisor: instance-store scratch not set up; scratch stays on the root volume" >&2
"""


def scratch_snippet(*, scratch_dir: str = SCRATCH_DIR, fstab: str = "/etc/fstab") -> str:
    """The bash snippet (text, ends with a newline) that turns the instance-store NVMe
    disks into the scratch directory; see the module docstring. Pure.

    ``scratch_dir`` / ``fstab``: where to mount and record it (tests point them at a
    temporary directory). Needs bash (arrays, process substitution), ``lsblk``,
    ``mkfs.ext4``, ``mount``, ``mountpoint`` and, for several disks, ``mdadm``.
    """
    return _SNIPPET.format(dir=shlex.quote(scratch_dir), fstab=shlex.quote(fstab),
                           model=shlex.quote(INSTANCE_STORE_MODEL))

"""A plain Hugging Face Trainer script, as a user would write it.

A tiny GPT-2 built from a config (nothing downloaded) on rows of random tokens, the
user's own TrainingArguments and dataset, resuming from the newest checkpoint in its
output dir. ``vanilla_train.py`` has nothing of spotvisor's; ``train.py`` is the same file
plus the import and the ``add_callback`` line (tests/test_hf_callback.py checks the diff).
"""

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from trainer.integrations.hf import SpotvisorCallback


class TokenRows(torch.utils.data.Dataset):
    """``samples`` rows of ``seq_len`` random tokens (seeded), each a causal-LM example."""

    def __init__(self, samples: int, seq_len: int) -> None:
        self.rows = torch.randint(1, 256, (samples, seq_len), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Pace(TrainerCallback):
    """Each optimizer step takes at least ``step_s`` seconds: the real model's compute, on
    a model this small (so a schedule by step lands where it says on any machine)."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.began = step_s, time.monotonic()

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(max(0.0, self.step_s - (time.monotonic() - self.began)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", default="out")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=480)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--step-s", type=float, default=0.0)
    a = p.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=a.seq_len,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=a.output_dir, max_steps=a.max_steps, save_steps=a.save_steps,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
                             logging_steps=10, report_to="none", seed=0, disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=TokenRows(a.samples, a.seq_len),
                      callbacks=[Pace(a.step_s)])
    trainer.add_callback(SpotvisorCallback())
    trainer.train(resume_from_checkpoint=get_last_checkpoint(a.output_dir))
    trainer.save_model()


if __name__ == "__main__":
    main()

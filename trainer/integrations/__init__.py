"""Adapters that put users' own training code on spotvisor's commit protocol and guard:
DeepSpeed (:mod:`.deepspeed`), the Hugging Face Trainer (:mod:`.hf`) and torch DCP
(:mod:`.dcp`). :mod:`.common` holds the directory commit they share."""

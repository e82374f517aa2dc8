"""Runnable example trainers built on the integrations: ``python -m trainer.examples.<name>`` under torchrun."""

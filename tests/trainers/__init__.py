"""Test trainers as real modules: the stand-in a node agent runs as its trainer
(:mod:`trainers.standin`)."""

from pathlib import Path

#: this folder
TRAINERS = Path(__file__).resolve().parent
#: the trainer stand-in's script, run by path (:mod:`trainers.standin`)
STANDIN = TRAINERS / "standin.py"

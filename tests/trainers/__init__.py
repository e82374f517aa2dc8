"""Test trainers as real modules: the stand-in a node agent runs as its trainer
(:mod:`trainers.standin`), the elastic job the in-process resize tests run in real
worker processes (:mod:`trainers.elastic_job`), the jobs' code the delivery tests
ship in ``job.workdir`` (:mod:`trainers.workdir_standin`, :mod:`trainers.spot_code_job`),
and a user's own script for ``job.command`` (:mod:`trainers.plain_script`).
``tests/`` is on ``PYTHONPATH`` in the tests (pytest's rootdir) and in the workers they
start (``worker_procs``)."""

from pathlib import Path

#: this folder
TRAINERS = Path(__file__).resolve().parent
#: the trainer stand-in's script, run by path (:mod:`trainers.standin`)
STANDIN = TRAINERS / "standin.py"

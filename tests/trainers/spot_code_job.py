"""The paced reference trainer (:mod:`e2e.paced_trainer`) shipped as the job's code
(``job.workdir``) in tests/e2e/test_delivery_e2e.py: the test copies it into the workdir
as ``spot_code_job.py`` (run as ``-m spot_code_job``). Before training it checks that
``job.setup`` ran first in this directory (its ``setup-marker``) and that the job's
environment is what the test set (:func:`e2e.env_trainer.check_env`); either missing:
exit 3. A test ships a new version by editing ``CODE_VERSION``.
"""

import os
import sys

CODE_VERSION = "v1"


def main() -> int:
    if not os.path.exists("setup-marker"):  # job.setup runs first, in this directory
        print("spot_code_job: no setup-marker in", os.getcwd(), file=sys.stderr)
        return 3
    from e2e.env_trainer import check_env  # job.env and job.secrets, by hash

    if not check_env():
        print("spot_code_job: the job's environment is not what the test expected", file=sys.stderr)
        return 3
    from e2e.paced_trainer import main as paced_main

    return paced_main()


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())

"""``elastic_tools.training.worker`` plus the ``flaky://`` test filesystem (run by torchrun)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flaky_fs import register

from elastic_tools.training.worker import main

if __name__ == "__main__":
    register()
    sys.exit(main())

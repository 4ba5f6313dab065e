import sys

from accel_ddp.cli import main

sys.exit(main())

import sys

from accel_ddp.cli.commands import main

sys.exit(main())

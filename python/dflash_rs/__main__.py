import sys

from dflash_rs.cli import main

sys.exit(main())

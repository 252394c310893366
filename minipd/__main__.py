import sys

from minipd.cli import main

sys.exit(main())

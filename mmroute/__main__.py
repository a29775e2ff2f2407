import sys

from mmroute.cli import main

sys.exit(main())

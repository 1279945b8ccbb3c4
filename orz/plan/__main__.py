import sys

from orz.plan.cli import main

sys.exit(main())

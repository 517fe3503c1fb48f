import sys

from attnslim.cli import main

sys.exit(main())

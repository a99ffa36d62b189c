import sys

from pipemark.cli import main

sys.exit(main())

import sys

from glmkit.cli import main

sys.exit(main())

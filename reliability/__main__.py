import sys

from reliability.scenarios.run import main

sys.exit(main())

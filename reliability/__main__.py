import sys

from reliability.run import main

sys.exit(main())

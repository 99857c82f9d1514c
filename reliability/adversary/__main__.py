import sys

from reliability.adversary.run import main

sys.exit(main())

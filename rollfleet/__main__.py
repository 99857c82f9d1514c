from rollfleet.cli import main

raise SystemExit(main())

from tidegate.cli import main

raise SystemExit(main())

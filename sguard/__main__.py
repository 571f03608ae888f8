from sguard.cli import main

raise SystemExit(main())

from gateway.cli.entry import main

raise SystemExit(main())

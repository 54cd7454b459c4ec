from gateway.runtime.cli import main

raise SystemExit(main())

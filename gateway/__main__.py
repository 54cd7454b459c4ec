from gateway.runtime.entry import main

raise SystemExit(main())

"""A plugin that ends the interpreter on import when a dependency is missing (the
"requires X" idiom, ``raise SystemExit(...)``), named by an entry point of each of the
three groups: hurraykv skips it with the group's warning, as any plugin that fails, and
the command goes on."""

raise SystemExit("exiting_plugin requires hurraykv-acme-sdk, which is not installed")

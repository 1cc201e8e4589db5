"""The application shell: the CLI, the root recipe and its cross-section rules, preflight (the
checks `validate` and `run` share), metric names, the console, the report and timeline plots,
and export/generate. It is the one layer that knows every other: it builds the backends the
recipe names and hands the stages what they run on.
"""

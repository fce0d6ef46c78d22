"""HDET's rules, pure (no Lightning, no process groups; tests/test_layout.py checks the folder): each rule one object
holding its options, their checks and its behaviour (a vote's ``explore``, the safety net's ``judge``, a signal's
``scores``), and the controller that runs them (one interval in, one decision out). docs/architecture.md says how to
add a rule."""

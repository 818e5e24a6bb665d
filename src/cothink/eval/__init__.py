"""The evaluation suite: `cothink eval <suite>|all` (see docs/evaluation.md)."""

"""The paper's experiments, one module each on the shared harness (`cothink.experiments.harness`)."""

"""Export verification and publishing: the run_export entry, parity, model cards, Modelfiles,
adapter export."""

"""Management commands of the control plane."""

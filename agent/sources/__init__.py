"""Sources of measurements, one module per subsystem, all behind `base.Source`."""

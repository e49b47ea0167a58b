"""Training: the Trainer that builds mesh, state and jitted steps (`trainer`), the pure step
(`step`), the model cut into pipeline stages (`stages`), the data-parallel reduction, the
optimizers and learning-rate schedules, the loop and its policy, and the FLOP and memory
accounting that MFU and the fit check use."""

"""Checkpoints: the Orbax manager that saves and restores a train state (`manager`), content
fingerprints that prove a restore (`fingerprint`), the interval that loses least time
(`cadence`), and the parameters-only checkpoints that export, generation and fine-tuning read
(`params`)."""

"""A fleet: several supervisors sharing their bindings (pure decision parts and members)."""

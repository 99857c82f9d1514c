"""The fleet's own control loop: a demand signal read from the broker, a pure plan, drivers that
carry it out (``rollfleet autoscale``). Nothing else in rollfleet imports this room but the CLI."""

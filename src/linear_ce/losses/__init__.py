"""Loss plug-ins ("heads") of the chunk loop; the protocol is :mod:`linear_ce.engine.head`."""

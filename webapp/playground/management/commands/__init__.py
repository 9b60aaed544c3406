"""`manage.py` commands: swarm_up."""

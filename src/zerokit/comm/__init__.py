"""Communication: collectives with deadlines and error text (collectives.py `Comm`), the check that
ranks run the same collective (agreement.py), and which device a rank computes on (devices.py)."""

"""Units: a group of parameters gathered, reduced and stepped together (unit.py), which modules
become units (wrap.py, leaf.py), the read lease an asynchronous save holds (lease.py) and the
DeepSpeed attributes on their parameters (ds_attributes.py)."""

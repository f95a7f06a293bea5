"""Leader election: the protocol, the Kubernetes Lease elector and the PostgreSQL elector."""

"""The Serve side: the TP-group deployment and its workers, the HTTP ingress, the request router,
metrics, and Serve's validation of the computed options."""

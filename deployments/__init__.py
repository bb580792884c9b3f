"""Ray Serve side: TP-group workers, deployments, controller, autoscaling, HTTP, client."""

"""Ray Serve side: TP-group workers, deployments, controller, autoscaling, HTTP, client.

Public entry points: ``deployments.app:build_app`` (Serve builder), ``deployments.client``
(handle and HTTP clients), ``deployments/configs/*.yaml`` (``serve run``).
"""

import logging

# The one logger of the serving layer. A child of "ray.serve", so inside replicas its records
# land in the replica's Serve log next to Serve's own.
logger = logging.getLogger("ray.serve.latent_moe")

"""The controller service's routers, one per resource (included by `api.app.create_app`)."""

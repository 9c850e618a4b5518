from django.apps import AppConfig


class MachinesAppConfig(AppConfig):
    name = "machines_app"
    verbose_name = "Machines and model files"

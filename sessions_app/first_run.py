"""The front page's first-run checklist for staff (README.md, "First steps for an admin").

A new deployment has an admin, a machine and nothing else: the list page says what is left
to do, in order, each step with the admin page that does it and done once the database
shows it done. The checklist goes when every step is done; members never see it.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.urls import reverse

from machines_app.models import Machine, ModelFile

from .models import AgentSession


@dataclass(frozen=True)
class Step:
    key: str
    text: str  # what to do, as an imperative sentence
    how: str  # where, in a few words
    url: str
    done: bool


def steps() -> list[Step]:
    """The four steps with whether each is done: a member who is not staff exists; a
    machine was checked (its tool containment is known: Test connection, or a server
    started there); a machine's models were read and one can be started; a session exists."""
    machines = Machine.objects.filter(enabled=True)
    machine_list = reverse("admin:machines_app_machine_changelist")
    return [
        Step("member", "Add a member", "Admin → Users → Add user; team members need no staff status.",
             reverse("admin:auth_user_add"),
             get_user_model().objects.filter(is_active=True, is_staff=False).exists()),
        Step("machine", "Check the machine", "Admin → Machines: tick it, then the action “Test connection”.",
             machine_list, machines.exclude(containment=Machine.Containment.UNCHECKED).exists()),
        Step("models", "Refresh the models", "Admin → Machines: tick it, then “Refresh models” reads its GGUF files.",
             machine_list,
             ModelFile.objects.filter(machine__enabled=True, error="", missing_parts=[]).exists()),
        Step("session", "Start a session", "New session: pick the machine, a model and a working directory.",
             reverse("session_new"), AgentSession.objects.filter(purpose=AgentSession.Purpose.CHAT).exists()),
    ]


def checklist_for(user) -> list[Step] | None:
    """The checklist the list page shows ``user``: the steps while one is left, for staff
    only; None otherwise."""
    if not user.is_staff:
        return None
    found = steps()
    return None if all(step.done for step in found) else found

"""The new-session form (docs/behaviour.md §12): machine, model by name, working directory, parameters."""

from __future__ import annotations

from django import forms
from django.conf import settings

from machines_app import catalog
from machines_app.access import machines_for
from machines_app.discovery import InvalidModelKey, validate_key
from machines_app.models import Machine, ModelFile
from machines_app.transports import TransportError, one_reader, reader_for
from machines_app.workspaces import WorkingDirRefused, check_working_dir

from . import room
from .actions import check_permission_mode, may_bypass
from .models import AgentSession, DeploymentSettings
from .rules import SessionError, check_message, check_system_prompt, check_title


class NewSessionForm(forms.Form):
    """Bound to the user asking: only the machines open to them (machines_app.access), the
    working directory checked for them on that machine (machines_app.workspaces), and the
    gate-off mode offered only to whom may choose it."""

    machine = forms.ModelChoiceField(
        queryset=Machine.objects.none(),
        empty_label=None,
        error_messages={"invalid_choice": "There is no such machine, or it is not open to you."},
    )
    model_key = forms.ChoiceField(label="Model")
    working_dir = forms.CharField(
        max_length=1000,
        initial="~",
        help_text="Where the model's tools read, write and run commands, on the chosen machine: an absolute path "
        "or one in the home directory there (~/project).",
    )
    title = forms.CharField(max_length=200, required=False)
    permission_mode = forms.ChoiceField(
        choices=AgentSession.PermissionMode.choices, initial=AgentSession.PermissionMode.MANUAL
    )
    # Server parameters (llama-server flags, docs/behaviour.md §5)
    contextSize = forms.IntegerField(
        label="Context size (n_ctx)", required=False, min_value=128, max_value=4_194_304,
        help_text="Tokens the model holds at once; at most its trained context. Empty: llama-server's default.",
    )
    gpuLayers = forms.IntegerField(label="GPU layers", required=False, min_value=0, max_value=1000)
    threads = forms.IntegerField(required=False, min_value=1, max_value=1024)
    speculative = forms.ChoiceField(
        choices=[("auto", "Auto (MTP head if present)"), ("off", "Off")], initial="auto"
    )
    system_prompt = forms.CharField(
        required=False, max_length=100_000, widget=forms.Textarea(attrs={"rows": 3}),
        help_text="The first message of every request. Empty: the model file's default, else the deployment's.",
    )
    # Sampling parameters (ride on every request, docs/behaviour.md §5); an empty one is not
    # sent, so llama-server applies the model file's default, else its own (§17).
    temperature = forms.FloatField(required=False, min_value=0.0, max_value=5.0)
    top_p = forms.FloatField(required=False, min_value=0.0, max_value=1.0)
    top_k = forms.IntegerField(required=False, min_value=0, max_value=100_000)
    min_p = forms.FloatField(required=False, min_value=0.0, max_value=1.0)
    repeat_penalty = forms.FloatField(required=False, min_value=0.0, max_value=10.0)
    max_tokens = forms.IntegerField(required=False, min_value=1, max_value=4_194_304)
    seed = forms.IntegerField(required=False, min_value=0, max_value=2**32 - 1)

    # Import (docs/transcript.md, "Import"): a JSON Lines export the new session starts from.
    transcript = forms.FileField(
        label="Start from an export", required=False,
        help_text="A session's JSON Lines export (.jsonl): the new session holds its conversation and goes on "
        "from it. Who did what there is kept as names; nothing granted there is allowed here.",
        widget=forms.FileInput(attrs={"accept": ".jsonl,application/x-ndjson,application/json"}),
    )

    SERVER_FIELDS = ("contextSize", "gpuLayers", "threads", "speculative")
    SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "max_tokens", "seed")

    def __init__(self, *args, user, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        show_max_tokens_default(self)
        self.user = user
        self.fields["machine"].queryset = machines_for(user)
        if not may_bypass(user):
            # Not offered; a forged POST still reaches clean_permission_mode and is refused there.
            self.fields["permission_mode"].widget.choices = [
                c for c in AgentSession.PermissionMode.choices if c[0] != AgentSession.PermissionMode.BYPASS
            ]
        self.chosen_machine = machine = self._chosen_machine()
        self.model_choices = list(catalog.models_for(machine)) if machine else []
        if machine is not None:
            room.mark_fits(machine, self.model_choices)
        self.fields["model_key"].choices = [
            (m.key, m.display_name if m.is_complete else f"{m.display_name} — {m.problem}") for m in self.model_choices
        ]
        if not self.is_bound and "model_key" not in self.initial:
            # Preselect a model that can chat: one without a chat template answers badly.
            usable = [m for m in self.model_choices if m.is_complete]
            preferred = next((m for m in usable if m.has_chat_template), usable[0] if usable else None)
            if preferred is not None:
                self.initial["model_key"] = preferred.key
        key = self.data.get("model_key") if self.is_bound else self.initial.get("model_key")
        show_model_defaults(self, next((m for m in self.model_choices if m.key == key), None))

    def _chosen_machine(self) -> Machine | None:
        """The machine whose models the picker lists: the one asked for when it is a
        valid choice (the field itself judges, so '²', '' or a huge number never reach a
        query), else the first."""
        field = self.fields["machine"]
        value = self.data.get("machine") if self.is_bound else self.initial.get("machine")
        value = getattr(value, "pk", value)
        try:
            return field.clean(value)
        except forms.ValidationError:
            return field.queryset.first()

    def clean_model_key(self) -> str:
        key = self.cleaned_data["model_key"]
        try:
            validate_key(key)
        except InvalidModelKey as exc:
            raise forms.ValidationError(str(exc)) from None
        return key

    def clean_title(self) -> str:
        try:
            return check_title(self.cleaned_data["title"])
        except SessionError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_system_prompt(self) -> str:
        try:
            return check_system_prompt(self.cleaned_data["system_prompt"])
        except SessionError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_permission_mode(self) -> str:
        mode = self.cleaned_data["permission_mode"]
        try:
            check_permission_mode(session_owner=self.user, user=self.user, mode=mode)
        except SessionError as exc:
            raise forms.ValidationError(str(exc)) from None
        return mode

    def clean(self) -> dict:
        data = super().clean()
        machine, key = data.get("machine"), data.get("model_key")
        # One transport for both questions: a host that did not answer is said once, not waited for twice.
        reach = one_reader()
        if machine and key:
            try:
                model = catalog.model_for_session(machine, key, reach)
            except catalog.ModelUnavailable as exc:
                self.add_error("model_key", str(exc))
            else:
                if refusal := catalog.context_refusal(model, data.get("contextSize")):
                    self.add_error("contextSize", refusal)
                elif refusal := room.never_fits(machine, key, chosen_server_params(data)):
                    self.add_error("model_key", refusal)
        if machine and data.get("working_dir"):
            try:
                data["working_dir"] = check_working_dir(self.user, machine, data["working_dir"], reach)
            except WorkingDirRefused as exc:
                self.add_error("working_dir", str(exc))
            except TransportError as exc:
                self.add_error("machine", str(exc))
        return data

    def server_params(self) -> dict:
        """The server flags chosen; ``speculative`` only when turned off ("auto" is the default)."""
        return chosen_server_params(self.cleaned_data)

    def sampling(self) -> dict:
        return {k: self.cleaned_data[k] for k in self.SAMPLING_FIELDS if self.cleaned_data.get(k) is not None}


def chosen_server_params(data: dict) -> dict:
    """The server flags in a form's cleaned ``data``; ``speculative`` only when turned off."""
    return {
        k: data[k]
        for k in NewSessionForm.SERVER_FIELDS
        if data.get(k) not in (None, "") and not (k == "speculative" and data[k] == "auto")
    }


def show_model_defaults(form: forms.Form, model: ModelFile | None) -> None:
    """Show what an empty field leaves in force (docs/behaviour.md §17): each sampling field's
    placeholder is the model file's own default ("model default: 0.6", from its
    ``general.sampling.*`` keys) and the system prompt's is the prompt that would apply."""
    defaults = model.sampling_defaults if model is not None else {}
    for name in form.SAMPLING_FIELDS:
        widget = form.fields[name].widget
        if name in defaults:
            widget.attrs["placeholder"] = f"model default: {defaults[name]}"
        else:
            widget.attrs.pop("placeholder", None)
    show_max_tokens_default(form)  # no GGUF key for it: the deployment's default is the placeholder
    fallback = (model.system_prompt if model is not None else "") or DeploymentSettings.load().system_prompt
    widget = form.fields["system_prompt"].widget
    if fallback:
        widget.attrs["placeholder"] = fallback
    else:
        widget.attrs.pop("placeholder", None)
def show_max_tokens_default(form: forms.Form) -> None:
    """Say in the form what an empty max_tokens means: the deployment's default
    (``CORRAL_DEFAULT_MAX_TOKENS``), read when the form is made, never at import."""
    default = settings.CORRAL_DEFAULT_MAX_TOKENS
    field = form.fields["max_tokens"]
    field.widget.attrs["placeholder"] = f"{default} (default)"
    field.help_text = f"The longest reply, in tokens. Empty: {default:,}, this deployment's default."


class MachineChoiceForm(forms.Form):
    """The ``machine`` query parameter of the model picker: a Machine id among the machines
    open to ``user`` (enabled, and their groups allow it: machines_app.access)."""

    machine = forms.ModelChoiceField(
        queryset=Machine.objects.none(),
        error_messages={
            "required": "Choose a machine first.",
            "invalid_choice": "There is no such machine, or it is turned off or not open to you; reload the "
                              "page to see the machines.",
        },
    )

    def __init__(self, *args, user, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["machine"].queryset = machines_for(user)


class MessageForm(forms.Form):
    """A message to the model; :func:`sessions_app.rules.check_message` owns what may be
    sent and says why not (a plain Field, so Django's own NUL message never speaks first)."""

    text = forms.Field(widget=forms.Textarea(attrs={"rows": 3}), required=False)

    def __init__(self, *args, with_images: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.with_images = with_images  # images attached: the text may be empty

    def clean_text(self) -> str:
        try:
            return check_message(self.cleaned_data["text"] or "", with_images=self.with_images)
        except SessionError as exc:
            raise forms.ValidationError(str(exc)) from None


class SessionSettingsForm(forms.Form):
    """Title and parameters of an existing session (sampling applies at once, server
    parameters after a restart)."""

    title = forms.CharField(max_length=200, required=False)
    contextSize = NewSessionForm.base_fields["contextSize"]
    gpuLayers = NewSessionForm.base_fields["gpuLayers"]
    threads = NewSessionForm.base_fields["threads"]
    speculative = NewSessionForm.base_fields["speculative"]
    system_prompt = NewSessionForm.base_fields["system_prompt"]
    temperature = NewSessionForm.base_fields["temperature"]
    top_p = NewSessionForm.base_fields["top_p"]
    top_k = NewSessionForm.base_fields["top_k"]
    min_p = NewSessionForm.base_fields["min_p"]
    repeat_penalty = NewSessionForm.base_fields["repeat_penalty"]
    max_tokens = NewSessionForm.base_fields["max_tokens"]
    seed = NewSessionForm.base_fields["seed"]

    SERVER_FIELDS = NewSessionForm.SERVER_FIELDS
    SAMPLING_FIELDS = NewSessionForm.SAMPLING_FIELDS
    server_params = NewSessionForm.server_params
    sampling = NewSessionForm.sampling
    clean_system_prompt = NewSessionForm.clean_system_prompt
    clean_title = NewSessionForm.clean_title

    def __init__(self, *args, session: AgentSession | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        model = (
            ModelFile.objects.filter(machine_id=session.machine_id, key=session.model_key).first() if session else None
        )
        show_model_defaults(self, model)
        self.session = session

    def clean(self) -> dict:
        data = super().clean()
        if self.session is not None and data.get("contextSize") is not None:
            try:
                model = catalog.model_for_session(self.session.machine, self.session.model_key, reader_for)
            except catalog.ModelUnavailable:
                return data  # the restart says why it cannot start
            if refusal := catalog.context_refusal(model, data["contextSize"]):
                self.add_error("contextSize", refusal)
        return data

    @classmethod
    def for_session(cls, session: AgentSession) -> SessionSettingsForm:
        initial = {"title": session.title, "speculative": "auto", "system_prompt": session.system_prompt,
                   **session.server_params, **session.sampling}
        return cls(initial=initial, session=session)

# A session's server rows (ServerRecord, SlotSave) move from machines_app to
# sessions_app.servers. State only: their tables keep their names (db_table), so no row
# moves and nothing is locked. machines_app 0018 deletes them from machines_app's state.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('machines_app', '0017_machine_corral_host'),
        ('sessions_app', '0013_agentsession_purpose_api'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ServerRecord',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('model_key', models.CharField(max_length=1000)),
                        ('server_params', models.JSONField(blank=True, default=dict, help_text="The session's server parameters at start.")),
                        ('pid', models.PositiveIntegerField()),
                        ('start_time', models.CharField(max_length=40)),
                        ('port', models.PositiveIntegerField()),
                        ('api_key', models.CharField(blank=True, editable=False, max_length=100)),
                        ('log_path', models.CharField(max_length=1000)),
                        ('started_at', models.DateTimeField(auto_now_add=True)),
                        ('ready_at', models.DateTimeField(blank=True, null=True)),
                        ('stopping', models.BooleanField(default=False)),
                        ('slot_key', models.CharField(blank=True, max_length=64)),
                        ('machine', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, to='machines_app.machine')),
                        ('session', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='server', to='sessions_app.agentsession')),
                    ],
                    options={
                        'db_table': 'machines_app_serverrecord',
                    },
                ),
                migrations.CreateModel(
                    name='SlotSave',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('model_key', models.CharField(max_length=1000)),
                        ('fingerprint', models.CharField(max_length=64)),
                        ('n_tokens', models.PositiveIntegerField(default=0, help_text='Tokens in the saved KV cache (n_saved).')),
                        ('saved_at', models.DateTimeField(auto_now=True)),
                        ('machine', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, to='machines_app.machine')),
                        ('session', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='slot_saves', to='sessions_app.agentsession')),
                    ],
                    options={
                        'db_table': 'machines_app_slotsave',
                        'constraints': [models.UniqueConstraint(fields=('session', 'machine', 'model_key'), name='one_slot_save_per_session_model')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]

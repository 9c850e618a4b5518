# The hidden sessions that hold the API's servers (api_app, docs/api.md).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('sessions_app', '0011_stored_images'),
    ]

    operations = [
        migrations.AddField(
            model_name='agentsession',
            name='purpose',
            field=models.CharField(choices=[('chat', 'Chat'), ('api', 'API')], default='chat', max_length=10),
        ),
        migrations.AddField(
            model_name='agentsession',
            name='api_busy_until',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name='agentsession',
            constraint=models.UniqueConstraint(condition=models.Q(('purpose', 'api')), fields=('machine', 'model_key'), name='one_api_session_per_model_file'),
        ),
    ]

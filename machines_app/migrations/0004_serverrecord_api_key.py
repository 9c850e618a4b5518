from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('machines_app', '0003_server_params'),
    ]

    operations = [
        migrations.AddField(
            model_name='serverrecord',
            name='api_key',
            field=models.CharField(blank=True, editable=False, max_length=100),
        ),
    ]

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('sessions_app', '0002_mcp_server'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='agentsession',
            options={'ordering': ['-last_activity_at'], 'permissions': [('bypass_permissions', 'Can turn the permission gate off (run tools without asking)')]},
        ),
    ]

from django.db import migrations, models

import machines_app.workspaces


class Migration(migrations.Migration):

    dependencies = [
        ('auth', '0012_alter_user_first_name_max_length'),
        ('machines_app', '0004_serverrecord_api_key'),
    ]

    operations = [
        migrations.AddField(
            model_name='machine',
            name='allowed_groups',
            field=models.ManyToManyField(blank=True, help_text='Only members of these groups see this machine and start sessions on it. None selected: everyone. Staff are not limited.', related_name='machines', to='auth.group'),
        ),
        # Existing machines get "~" too: members keep their home directory there (docs/access.md).
        migrations.AddField(
            model_name='machine',
            name='workspace_roots',
            field=models.TextField(blank=True, default='~', help_text='Directories members may use as a working directory, one per line: absolute (/srv/work) or in the home directory on that machine (~, ~/projects). Symlinks are followed before comparing. Empty: any directory. Staff are not limited.', validators=[machines_app.workspaces.validate_workspace_roots]),
        ),
    ]

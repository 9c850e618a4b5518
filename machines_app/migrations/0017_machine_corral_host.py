"""Machine.corral_host: which Corral host a local machine is (docs/operations.md, "More
hosts"). Rows already there get "" (unclaimed): the first host whose ``corral setup`` (or
``./corral run``) runs after this claims the local one (corral_setup.ensure_local_machine)."""

from django.db import migrations, models

import machines_app.models


class Migration(migrations.Migration):

    dependencies = [
        ('machines_app', '0016_private_keys_in_the_database'),
    ]

    operations = [
        migrations.AddField(
            model_name='machine',
            name='corral_host',
            field=models.CharField(blank=True, default='', max_length=63, verbose_name='Corral host'),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name='machine',
            name='corral_host',
            field=models.CharField(blank=True, default=machines_app.models.this_host, help_text="For a local machine: the id of the Corral host it is (each host has its own local machine; its servers are started, watched and stopped by that host's workers only). Empty: the one host of a deployment that has one. Not used for SSH machines.", max_length=63, verbose_name='Corral host'),
        ),
    ]

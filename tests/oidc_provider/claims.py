from oauth2_provider.oauth2_validators import OAuth2Validator


class Validator(OAuth2Validator):
    """Claims of a directory: e-mail, user name, names, and ``groups`` (the user's Django
    groups here), the last with the profile scope, as Authentik sends them."""

    oidc_claim_scope = {**OAuth2Validator.oidc_claim_scope, "groups": "profile"}

    def get_additional_claims(self, request):
        user = request.user
        return {
            "email": user.email,
            "preferred_username": user.username,
            "given_name": user.first_name,
            "family_name": user.last_name,
            "groups": sorted(user.groups.values_list("name", flat=True)),
        }
